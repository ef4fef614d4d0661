import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # spawned ranks import test modules and helpers by name

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def s3_server_once(tmp_path_factory):
    """One SeaweedFS S3 server for the session (test_s3, the soak): started on first use."""
    import s3_server
    server = s3_server.start(str(tmp_path_factory.mktemp("s3")))
    try:
        yield server
    finally:
        s3_server.stop(server)
