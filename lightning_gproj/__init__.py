"""lightning-gproj: numerically safe BF16 attention training for PyTorch Lightning (see README.md)."""
