"""Adapters that make statesnap one line to adopt in the trainers people already use.

Each submodule imports its framework only when it is imported itself, so ``import statesnap``
never pulls in Lightning, transformers, accelerate or torchtitan. Install the matching extra:
``pip install 'statesnap[lightning]'``, ``'statesnap[hf]'``, ``'statesnap[torchtitan]'``.
"""
