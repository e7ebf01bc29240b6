"""The source model: MLA geometry from config.json, its checkpoint files, Hub ids, synthetic checkpoints."""
