"""What lives on the server, byte by byte: key names, the versioned header, codecs, offset tables,
segments, the op kinds of the scripts.  Imports nothing heavy here: the command line loads parts of it
without torch.
"""
