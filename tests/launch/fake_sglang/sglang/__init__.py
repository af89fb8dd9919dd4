"""A fake `sglang` package for tests: put first on PYTHONPATH, `python -m sglang.launch_server` starts the SGLang
stand-in of tests/dcs/sglang_receiver.py behind SGLang 0.5.23's launcher (its flags, `--config` file and api-key
check). Real SGLang needs NVIDIA GPUs and cannot run where the tests run."""

__version__ = "0.5.23"
