"""What lives on the server, byte by byte: key names, the versioned header and its sampling policy,
codecs, offset tables, segments, the op kinds of the scripts, read transactions on the wire.  Imports
nothing heavy here: the command line loads parts of it without torch.
"""
