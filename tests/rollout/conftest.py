from tests.engine.conftest import engine, start_engine, tiny_model_dir  # noqa: F401 - fixtures shared with the engine's tests
