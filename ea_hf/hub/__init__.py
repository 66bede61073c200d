"""Publishing on the Hugging Face Hub: model cards (``cards.py``, with the origins of checkpoints in
``origins.py``), uploads and ``push_to_hub`` of EA models (``upload.py``), and publishing of run directories:
a run read once into a record (``run_record.py``), then its card rendered and pushed (``runs.py``: ``ea-hf
card``, ``ea-hf push``; both need the ``train`` extra, imported from there).
"""

from .cards import model_card, render_card
from .upload import HubError, publishable_files, push_model, save_preprocessor, upload

__all__ = ["HubError", "model_card", "publishable_files", "push_model", "render_card", "save_preprocessor", "upload"]
