"""Analysis graphs: built from a model to measure it, never written out or deployed.

- probe: taps every block's tensors (and each sequential block's mlp on resid_pre), so one forward pass
  gives every block's defect and geometry;
- switchboard: every pass that offers a switch, at every layer, turned on and off at run time by one input (kinds are
  Switch(pass name, typed args); each pass builds its own switch);
- fit_graph: the switchboard of the two forms (parallel, compensated) reduced to the taps the compensation fit sums;
- resumable: a run that starts at any block from an earlier run's stream;
- field: one block's mlp(ln2(z)) for any z.

diagnose (read-only) and the writing path (compensation's fit, `--layers auto`) both build on them.
"""
