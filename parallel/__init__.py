"""Model-agnostic distributed machinery: topology, P2P of tensor dicts, plans, publication."""
