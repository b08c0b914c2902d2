"""Circuits: the graph of a transformer's components (probe.circuits.component_graph), edge
and node scores over clean/corrupt pairs (EAP, EAP-IG, exact edge patching: probe.circuits.scores), and
forwards with chosen edges ablated (path patching, a circuit's evaluation:
probe.circuits.exact). docs/circuits.md tells the methods and their choices."""
