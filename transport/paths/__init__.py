"""Data paths: how a LAYER message's payload travels once its header is on the ZMQ control
connection (`base.py` holds the interface; `inline`, `tcp`, `shm` with CUDA IPC, `pg`)."""
