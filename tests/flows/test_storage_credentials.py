"""S3 with wrong credentials (issue 50 §2): ``aepo train`` stops before it starts, with one line naming the location
it could not use and S3's reason, exit code 2, no traceback, no MLflow run — whichever of the run's stores is on S3.

moto's server accepts any key unless told to authenticate (``INITIAL_NO_AUTH_ACTION_COUNT``): here it is, after an
IAM user with S3 rights is made, and a positive control shows the user's own keys still work, so the refusal is the
wrong key's, not a server that refuses everything."""

from __future__ import annotations

from pathlib import Path

import boto3
import pytest
from botocore.exceptions import ClientError
from test_cli import TINY, invoke, sets

S3_ALL = '{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}'


@pytest.fixture
def authenticating_s3(moto_s3: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """moto with authentication on; the access key of a user allowed every S3 action."""
    import moto.settings

    iam = boto3.client("iam", endpoint_url=moto_s3, region_name="us-east-1")
    iam.create_user(UserName="trainer")
    iam.put_user_policy(UserName="trainer", PolicyName="s3", PolicyDocument=S3_ALL)
    key = iam.create_access_key(UserName="trainer")["AccessKey"]
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    return {"id": key["AccessKeyId"], "secret": key["SecretAccessKey"]}


@pytest.mark.parametrize("where", ["storage.trajectories_uri", "storage.checkpoints_uri", "storage.evaluations_uri",
                                   "tracking.artifact_location"])
def test_wrong_s3_credentials_are_one_error_naming_the_location(authenticating_s3: dict[str, str], moto_s3: str,
                                                                 tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 where: str) -> None:
    def bucket(key_id: str, secret: str) -> list[str]:
        s3 = boto3.client("s3", endpoint_url=moto_s3, region_name="us-east-1", aws_access_key_id=key_id,
                          aws_secret_access_key=secret)
        return [o["Key"] for o in s3.list_objects_v2(Bucket="aepo").get("Contents", [])]

    assert bucket(authenticating_s3["id"], authenticating_s3["secret"]) == []  # the user's own keys work
    with pytest.raises(ClientError, match="InvalidAccessKeyId"):
        bucket("AKIAWRONGWRONGWRONG0", "not-the-secret")

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG0")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", moto_s3)
    runs = tmp_path / "runs"
    on_s3 = sets(f"{where}=s3://aepo/store", f"storage.s3_endpoint_url={moto_s3}")
    commands = [["train", "-c", TINY, *on_s3, *sets("train.steps=1")]]
    if where in ("storage.evaluations_uri", "tracking.artifact_location"):  # what `aepo eval` writes too
        commands.append(["eval", "-c", TINY, *on_s3])
    for command in commands:
        result = invoke(*command, "--runs-dir", str(runs))
        assert result.exit_code == 2, (command, result.output)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "s3://aepo/store" in lines[0], result.stderr
        assert "The AWS Access Key Id you provided does not exist" in lines[0]  # S3's InvalidAccessKeyId
        assert "Traceback" not in result.output
        assert not (runs / "mlflow.db").exists() and not (runs / "trajectories").exists()
