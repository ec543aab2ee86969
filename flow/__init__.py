"""The floor above the trainer and the decoder: train -> measure -> export -> serve.

``trainer/`` fits drafts and knows nothing of decoding; ``decoding/`` measures drafts and knows
nothing of training. This package is the only one that uses both: the ``specdraft-train`` app
(``flow/app.py``: Hydra, training, then the quickstart's measurement), the measurement after
training (``flow/measure.py``), how to serve what was trained (``flow/serve.py``) and the
target writing training data on the batched decoder (``flow/regenerate.py``,
``specdraft-prepare``).
"""
