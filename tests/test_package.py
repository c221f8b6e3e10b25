"""The package ships what it advertises and nothing that exists only for tests."""

from pathlib import Path

import posttrain

PACKAGE = Path(posttrain.__file__).parent


def test_advertised_trainer_names_are_the_one_trainer():
    from posttrain.trainer.trainer import RLTrainer

    for name in posttrain.__all__:
        assert getattr(posttrain, name) is not None, name
    assert posttrain.RayPPOTrainer is posttrain.GRPOTrainer is posttrain.PPOTrainer is RLTrainer


def test_no_test_scaffolding_in_the_package():
    assert not [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("testing.py")]
    import posttrain.data

    assert not hasattr(posttrain.data, "make_data_config")


def test_every_user_error_class_is_a_posttrain_error():
    from posttrain.checkpoint import CheckpointError
    from posttrain.data.schema import DataError
    from posttrain.errors import PosttrainError
    from posttrain.rewards.custom import RewardFunctionError
    from posttrain.rewards.dispatch import UnknownDataSourceError
    from posttrain.rewards.manager import RewardError
    from posttrain.trainer.resume import ResumeError
    from posttrain.trainer.trainer import NonFiniteError

    for cls in (posttrain.ConfigError, CheckpointError, DataError, RewardError, RewardFunctionError,
                UnknownDataSourceError, ResumeError, NonFiniteError):
        assert issubclass(cls, PosttrainError), cls
