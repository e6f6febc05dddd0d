"""xmoe from Python: `xmoe.torch.MoE`, xmoe's MoE layer as a PyTorch module (docs/pytorch.md)."""
__version__ = "0.1.0"
