"""commviz.launch: start YAML-configured experiments through torchrun."""
