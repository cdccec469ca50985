pytest_plugins = ["tests.conftest_hub"]
