"""Adapters that run the method's decode-time paths inside other libraries' models (transformers.py). The core imports
nothing from here."""
