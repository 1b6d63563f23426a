"""Checkpoints: DCP save / verify / resume / retention (manager), the COMPLETE manifest and its check
(manifest, verify), reading pickles without running code (safe_unpickle), the errors (errors), the full
weights as one .safetensors file (weights), and opening a trained model from any checkpoint path for the
commands that use one (open)."""
