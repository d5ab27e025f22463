"""quantmla: a harness for low-bit MLA KV-cache quantization (QuantMLA and its baselines)."""

__version__ = "0.1.0"
