"""placer: place every layer of a PyTorch model on devices, from one YAML spec."""
__version__ = "0.1.0"
