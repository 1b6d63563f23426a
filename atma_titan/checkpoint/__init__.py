"""Checkpoints: DCP save / verify / resume / retention (manager), the COMPLETE manifest and its check
(manifest, verify), reading pickles without running code (safe_unpickle), the errors (errors), and opening
a trained model from any checkpoint path for the commands that use one (open)."""
