"""`jaxinfer bench`: the command is `jaxinfer_tools.bench.run`; the sweep,
machine probes, peers, targets, report and plots are its sibling modules."""
