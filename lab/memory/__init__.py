"""Each role's GPU memory at a released model's size, measured on the roles' own code under torch's
FakeTensorMode and memory trackers (docs/memory/README.md): measure.py runs the phases,
fake_run.py is the fake-tensor scope, trackers.py the trackers, fake_parts.py what stands in for the
wire, the rewards and the store."""
