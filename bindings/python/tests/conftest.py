import pytest

import kvguard
from pool import small_config


@pytest.fixture
def config():
    return small_config()


@pytest.fixture
def table(config):
    return kvguard.OwnershipTable(config)
