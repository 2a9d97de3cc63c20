"""`pdcluster plan`: calibrate the engine's step and transfer costs, simulate a cluster
running the real placement and routing code, and recommend a prefill:decode split."""
