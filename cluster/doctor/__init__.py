"""`pdcluster doctor`: reads a deployment (and optionally a load-test run) and names the
symptoms it finds, each with its numbers and the technique or setting that fits."""
