"""The device layer: registers "tpu" with PyTorch (the PrivateUse1 backend, ``torch.tpu``, autocast)."""
