"""Model families. Each subfolder is flat and Hub-copyable (see models/kimi_hybrid)."""
