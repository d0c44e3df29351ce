"""OpenEnv environments as episodes (``OpenEnvEnvironment``), on OpenEnv's own classes: in the process, and on OpenEnv's
server in a subprocess on 127.0.0.1 through its WebSocket client. Observations become messages, turns become
actions (text, or MCP tool calls), rewards and ``done`` become Steps; each episode is one session, closed after it;
seeds come from the row; and every fault is one line."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("openenv")

from rlhf_lightning.cli.errors import one_line  # noqa: E402
from rlhf_lightning.environments import OpenEnvEnvironment  # noqa: E402
from rlhf_lightning.environments.guess_number import GuessNumberTask, secret_of, solved  # noqa: E402
from rlhf_lightning.environments.openenv_server import StartedServer  # noqa: E402
from rlhf_lightning.environments.openenv_sessions import RemoteSession  # noqa: E402
from rlhf_lightning.environments.openenv_support import OpenEnvError, episode_seed  # noqa: E402
from rlhf_lightning.utils.managed_server import free_port  # noqa: E402
from tests.environments.openenv_envs import EchoEnvironment  # noqa: E402
from tests.helpers.cli import REPO  # noqa: E402

ECHO = "tests.environments.openenv_envs.EchoEnvironment"
GAME = "rlhf_lightning.environments.guess_number.GuessNumberEnvironment"


def turn(text="", calls=(), invalid=()):
    return [{"role": "assistant", "content": text, "tool_calls": list(calls), "invalid_tool_calls": list(invalid)}]


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def raises_one_line(function, *pieces):
    with pytest.raises(OpenEnvError) as caught:
        function()
    line = one_line(caught.value)
    assert "\n" not in line and all(piece in line for piece in pieces), line
    return line


# ---- in the process ------------------------------------------------------------------------------------------------

def test_a_game_in_the_process_reads_observations_sends_actions_and_takes_reward_and_done():
    environment = OpenEnvEnvironment(env=GAME)
    secret = secret_of(41)
    assert environment.reset({"prompt": "ignored", "seed": 41}) == [
        {"role": "user", "content": "guess my number, 1 to 20"}]
    low = 1 if secret != 1 else 2
    step = environment.step(turn(str(low)))
    assert step.messages == [{"role": "user", "content": "higher"}] and step.reward == 0 and not step.done
    # text the action does not validate is the policy's mistake: it reads why, the episode goes on
    step = environment.step(turn("twelve"))
    assert step.messages[0]["content"].startswith("error: guess:") and step.counts["invalid_actions"] == 1
    step = environment.step(turn(f" {secret}"))
    assert step.done and step.reward == 1.0 and step.messages == []
    assert environment.session is None and environment.source.live == 0  # the session closed with the episode


def test_each_episode_is_one_session_closed_after_it_however_it_ends():
    closed = EchoEnvironment.closed
    environment = OpenEnvEnvironment(env=ECHO, env_args={"greeting": "hi"})
    assert environment.reset({"prompt": "p", "seed": 3}) == [{"role": "user", "content": "hi 3"}]
    step = environment.step(turn("abc"))
    assert step.messages == [{"role": "user", "content": "echo abc"}] and step.reward == 0.5
    environment.reset({"prompt": "p", "seed": 4})  # a new episode on the same object: the old session closed
    environment.close()  # the rollout ends an episode that ran out of turns
    environment.close()
    assert EchoEnvironment.closed == closed + 2 and environment.source.live == 0


def test_seeds_come_from_the_row_so_a_resumed_run_and_a_group_replay_the_same_episode(monkeypatch):
    row = {"prompt": "what?", "level": 2}
    first = episode_seed(row, 7, "seed")
    assert first == episode_seed(dict(row), 7, "seed")  # the same row, the same game: on resume, in a group
    assert first != episode_seed(row, 8, "seed") and first != episode_seed({**row, "level": 3}, 7, "seed")
    assert episode_seed({**row, "seed": 12}, 7, "seed") == 12  # a dataset that fixes its games
    # the run's seed is seed_everything's unless given
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    environment = OpenEnvEnvironment(env=ECHO)
    assert environment.reset(row)[0]["content"] == f"hello {first}"
    assert OpenEnvEnvironment(env=ECHO, seed=8).reset(row)[0]["content"] == f"hello {episode_seed(row, 8, 'seed')}"
    with pytest.raises(ValueError, match="non-negative integer"):
        environment.reset({**row, "seed": -1})


def test_the_games_rows_replay_their_games():
    task = GuessNumberTask(seed=3)
    rows = task.prompt_rows(4)
    assert rows == GuessNumberTask(seed=3).prompt_rows(4) and rows != GuessNumberTask(seed=4).prompt_rows(4)
    games = [row["seed"] for row in rows]
    found = [f"10 lower {secret_of(game)}" for game in games]
    assert solved([row["prompt"] for row in rows], found) == [1.0] * 4  # from the prompt alone (a gold reward)
    assert solved(["x"] * 4, found, seed=games) == [1.0] * 4
    assert solved(["x"] * 4, ["21"] * 4, seed=games) == [0.0] * 4
    demonstration = task.sft_rows(1)[0]["completion"]
    assert demonstration[-1]["role"] == "assistant" and len(demonstration) <= 9


def test_mcp_tools_in_the_process_are_shown_and_called():
    environment = OpenEnvEnvironment(env="tests.environments.openenv_envs.AdderEnvironment", mcp_tools=True)
    schema = environment.tools["add"].schema["function"]
    assert schema["name"] == "add" and set(schema["parameters"]["properties"]) == {"a", "b"}
    # the reset observation has nothing to read: the opening is the row's prompt
    assert environment.reset({"prompt": "add to ten"}) == [{"role": "user", "content": "add to ten"}]
    step = environment.step(turn(calls=[call("add", a=2, b=3), call("nope")], invalid=["not JSON"]))
    assert [m["content"] for m in step.messages] == ["error: not JSON", "5", "error: Unknown tool: 'nope'"]
    assert step.counts["tool_calls"] == 2 and step.counts["tool_errors"] == 1 and step.counts["invalid_tool_calls"] == 1
    step = environment.step(turn(calls=[call("add", a=4, b=6)]))
    assert step.done and step.reward == 1.0
    assert environment.reset({"prompt": "again"}) and environment.step(turn("no call")).done  # no text action


def test_faults_in_the_process_are_one_line():
    slow = OpenEnvEnvironment(env=ECHO, timeout=0.5)
    slow.reset({"prompt": "p"})
    start = time.monotonic()
    raises_one_line(lambda: slow.step(turn("sleep")), "EchoEnvironment: step(EchoAction) did not return within 0.5 s")
    assert time.monotonic() - start < 5
    bad = OpenEnvEnvironment(env=ECHO)
    bad.reset({"prompt": "p"})
    raises_one_line(lambda: bad.step(turn("invalid")), "returned an observation (EchoObservation) that does not validate", "message")
    pair = OpenEnvEnvironment(env=ECHO, action="tests.environments.openenv_envs.PairAction", text_field="message")
    pair.reset({"prompt": "p"})
    raises_one_line(lambda: pair.step(turn("hi")), "the action PairAction does not validate", "volume")
    single = "tests.environments.openenv_envs.SingleSessionEcho"
    first, second = OpenEnvEnvironment(env=single), OpenEnvEnvironment(env=single)
    first.reset({"prompt": "p"})
    raises_one_line(lambda: second.reset({"prompt": "p"}), "SUPPORTS_CONCURRENT_SESSIONS")
    first.close()
    with pytest.raises(ValueError, match="not both"):
        OpenEnvEnvironment(env=ECHO, base_url="http://127.0.0.1:1")


def test_without_the_package_the_line_names_the_extra(monkeypatch):
    for name in [name for name in sys.modules if name == "openenv" or name.startswith("openenv.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "openenv", None)  # what an environment without the package imports
    monkeypatch.delitem(sys.modules, "rlhf_lightning.environments.guess_number")
    from rlhf_lightning.environments import openenv as adapter

    adapter.close_sources()
    with pytest.raises(ImportError) as caught:
        OpenEnvEnvironment(env=GAME)
    line = one_line(caught.value)
    assert line.startswith("error: OpenEnvEnvironment needs the optional package openenv, which is not installed (")
    assert line.endswith("): pip install -e '.[openenv]'") and "\n" not in line
    with pytest.raises(ImportError, match=r"guess_number needs the optional package openenv.*\.\[openenv\]"):
        import rlhf_lightning.environments.guess_number  # noqa: F401
    adapter.close_sources()


# ---- on OpenEnv's server -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def echo_server():
    """OpenEnv's server for the echo environment in a subprocess on 127.0.0.1, two sessions at most."""
    with StartedServer(ECHO, {}, 2) as server:
        yield server


@pytest.mark.slow
def test_a_server_session_per_episode_over_websocket(echo_server):
    environment = OpenEnvEnvironment(base_url=echo_server.url, action="tests.environments.openenv_envs.EchoAction")
    assert environment.reset({"prompt": "p", "seed": 5}) == [{"role": "user", "content": "hello 5"}]
    assert RemoteSession.open_sessions[echo_server.url] == 1
    assert environment.step(turn("abc")).messages == [{"role": "user", "content": "echo abc"}]
    step = environment.step(turn("done"))
    assert step.done and step.reward == 1.0 and RemoteSession.open_sessions[echo_server.url] == 0
    # a generic client without the action class: the text field is named
    plain = OpenEnvEnvironment(base_url=echo_server.url, text_field="message")
    plain.reset({"prompt": "p", "seed": 1})
    assert plain.step(turn("x")).reward == 0.5
    plain.close()


@pytest.mark.slow
def test_server_faults_are_one_line(echo_server):
    raises_one_line(lambda: OpenEnvEnvironment(base_url=f"http://127.0.0.1:{free_port()}", text_field="message"),
                    "cannot reach the OpenEnv server at http://127.0.0.1:", "Connection refused")
    # the session limit: this process holds both, so waiting could not help
    held = [OpenEnvEnvironment(base_url=echo_server.url, text_field="message") for _ in range(3)]
    held[0].reset({"prompt": "p"})
    held[1].reset({"prompt": "p"})
    start = time.monotonic()
    raises_one_line(lambda: held[2].reset({"prompt": "p"}), "refused reset", "CAPACITY_REACHED",
                    "this process holds 2 of them", "max_concurrent_envs")
    assert time.monotonic() - start < 5
    for environment in held:
        environment.close()
    # an observation the typed client does not validate; a step past the timeout
    typed = OpenEnvEnvironment(base_url=echo_server.url, client="tests.environments.openenv_envs.EchoClient",
                               action="tests.environments.openenv_envs.EchoAction", timeout=1.0)
    typed.reset({"prompt": "p"})
    raises_one_line(lambda: typed.step(turn("invalid")), "the answer to step(EchoAction) does not validate as "
                    "EchoClient's models", "message")
    typed.reset({"prompt": "p"})
    raises_one_line(lambda: typed.step(turn("sleep")), f"OpenEnv server {echo_server.url} did not answer "
                    "step(EchoAction) within 1 s")


HOLD_SESSIONS = """
import sys, time
from openenv.core import GenericEnvClient
clients = [GenericEnvClient(base_url=sys.argv[1]).sync() for _ in range(2)]
for client in clients:
    client.reset(seed=0)
print("held", flush=True)
time.sleep(120)
"""


@pytest.mark.slow
def test_a_server_whose_sessions_other_clients_hold_is_waited_for_aloud(capsys, monkeypatch):
    from rlhf_lightning.utils import retrying
    from tests.helpers.waits import watch

    monkeypatch.setattr(retrying, "NOTICE_EVERY", 0.5)
    echo_server = StartedServer(ECHO, {}, 2)  # its own: the module's server may still hold other tests' sessions
    echo_server.start()
    other = subprocess.Popen([sys.executable, "-c", HOLD_SESSIONS, echo_server.url], cwd=REPO, text=True,
                             stdout=subprocess.PIPE)
    try:
        assert other.stdout.readline().strip() == "held"
        environment = OpenEnvEnvironment(base_url=echo_server.url, text_field="message", timeout=2.0)
        waited = watch(lambda: environment.reset({"prompt": "p", "seed": 1}), capsys)
    finally:
        other.kill()
        other.wait()
        echo_server.stop()
    first_at, first = waited.lines[0]
    assert first == (f"warning: OpenEnv server {echo_server.url}: refused reset(seed=1) (CAPACITY_REACHED): Server "
                     "at capacity: 2/2 sessions active. Cannot accept new connections; trying again for up to 2 s (the adapter's timeout 2 s)")
    assert first_at < 3.0 and any(" still no answer after 1 s " in line for line in waited.texts())
    assert isinstance(waited.error, OpenEnvError) and waited.seconds >= 2.0
    assert str(waited.error).endswith(", for 2 s (the adapter's timeout): other clients hold its sessions")


@pytest.mark.slow
def test_a_started_server_that_dies_mid_episode_is_one_line_with_its_log():
    environment = OpenEnvEnvironment(env=ECHO, serve=True, max_concurrent_envs=3, timeout=10.0)
    environment.reset({"prompt": "p"})
    line = raises_one_line(lambda: environment.step(turn("exit")), "closed the connection during step(EchoAction): "
                           "the server stopped or crashed", "exited with code 3; its log: ")
    assert "server.log" in line


def openenv_loop_threads() -> int:
    return sum(thread.name == "openenv clients" for thread in threading.enumerate())


@pytest.mark.slow
def test_a_started_server_and_its_sessions_loop_stop_when_the_fit_ends():
    """What the fit's teardown calls (``Environment.close_shared``): the server the fit started is stopped and the
    event loop of its sessions ended; an episode after it starts a server again."""
    environment = OpenEnvEnvironment(env=ECHO, serve=True, max_concurrent_envs=2)
    loops = openenv_loop_threads()
    environment.reset({"prompt": "p", "seed": 2})
    assert environment.step(turn("abc")).messages == [{"role": "user", "content": "echo abc"}]
    environment.close()
    server = environment.source.server
    assert server.running and openenv_loop_threads() == loops + 1
    environment.close_shared()
    assert server.process.poll() is not None and openenv_loop_threads() == loops
    raises_one_line(lambda: OpenEnvEnvironment(base_url=server.url, text_field="message"),
                    f"cannot reach the OpenEnv server at {server.url}")
    again = OpenEnvEnvironment(env=ECHO, serve=True, max_concurrent_envs=2)
    assert again.source.server is not server and again.source.server.running
    again.close_shared()
    again.close_shared()  # idempotent
    assert again.source.server.process.poll() is not None


@pytest.mark.slow
def test_mcp_tools_on_a_server():
    environment = OpenEnvEnvironment(env="tests.environments.openenv_envs.AdderEnvironment", serve=True,
                                     mcp_tools=True)
    assert list(environment.tools) == ["add"]
    environment.reset({"prompt": "add"})
    step = environment.step(turn(calls=[call("add", a=2, b=3)]))
    assert step.messages == [{"role": "tool", "name": "add", "content": "5"}]
    assert environment.step(turn(calls=[call("add", a=5, b=5)])).done


@pytest.mark.slow
def test_the_command_line_without_the_package_prints_one_line(tmp_path):
    code = ("import runpy, sys; sys.modules['openenv'] = None; sys.argv = ['rlhf_lightning', 'fit', '--config', "
            f"'configs/openenv_sft.yaml', '--trainer.default_root_dir={tmp_path}']; "
            "runpy.run_module('rlhf_lightning', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0 and lines[-1].startswith("error: ") and "pip install -e '.[openenv]'" in lines[-1]
    assert "Traceback" not in done.stderr
