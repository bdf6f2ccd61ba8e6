"""Planning: from a Python index and values to the ops of one server call, and from its reply back to
tensordicts.
"""
