"""Hydra configuration (YAML). A package only so that the files ship with the install."""
