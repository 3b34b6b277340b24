"""The strategy layer: ``ThreeDStrategy`` and what it applies to a model."""
