"""Property tests of the pure core: stateful, reference model, exhaustive, phase x event."""
