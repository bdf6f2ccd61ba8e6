"""What the store classes share: the element view, the read and write surfaces, key changes,
lifecycle, uploads and the rest of the ``TensorDictBase`` surface.
"""
