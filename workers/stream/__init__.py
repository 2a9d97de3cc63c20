"""The worker stream: routers call a worker replica's `generate` (and decode calls prefill)
over one authenticated ZeroMQ socket per replica, not through Serve handles."""
