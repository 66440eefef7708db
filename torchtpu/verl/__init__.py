"""VeRL on device "tpu" (placeholder while the plugin is written)."""


def register():
    pass
