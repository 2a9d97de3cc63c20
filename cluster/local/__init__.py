"""Local runs on one machine: a private Ray + Serve, the apps and traffic the demo and the
cluster benchmark deploy and send, and `pdcluster demo`."""
