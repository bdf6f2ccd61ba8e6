"""The storage engine: one planned call sent as one round trip (a script or a checked transaction),
connections, deadlines, and stores spread over a cluster.  Imports nothing heavy here.
"""
