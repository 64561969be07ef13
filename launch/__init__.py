"""Launch scripts: Cloud TPU VMs (`tpu_vm.py`) and multi-host GPU clusters (`multihost.py`)."""
