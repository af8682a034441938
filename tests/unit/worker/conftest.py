import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank(tmp_path):
    """A real one-rank gloo process group in the test process (what the worker's collectives run on), for
    the test's duration."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
