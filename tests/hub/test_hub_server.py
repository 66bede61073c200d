"""The real `huggingface_hub` client (and transformers' push_to_hub / from_pretrained) against `hub_server.FakeHub`.

These tests also document the client behaviours the fake relies on (huggingface_hub 2.4, transformers 5.23):

- upload_folder uses Xet whenever `hf_xet` is installed; `hub.patch_client` sets `HF_HUB_DISABLE_XET` so that the
  legacy path runs: preupload -> LFS batch -> PUT (+ verify) -> NDJSON commit.
- Unchanged files are skipped by comparing the preupload `oid` with a local one (sha256 for LFS files, git blob
  sha1 otherwise); when nothing is left the client makes no commit but still asks the LFS batch API (no actions).
- 5xx answers are retried with backoff (1 s, 2 s, 4 s, 8 s, 8 s) on preupload, the LFS batch, the LFS PUT and verify,
  and tree listings; never on create_repo, whoami, repo_info or the commit itself. A failed HEAD on /resolve is
  tried again at once (with backoff) when nothing is cached.
"""

import hashlib
import json
import os

import pytest
import torch
import transformers
from hub_server import GITATTRIBUTES
from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import get_session

TOKEN = "hf_test_token"
REPO = "test-user/demo"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

# huggingface_hub itself PUTs LFS files with httpx2's deprecated `data=<file>`


@pytest.fixture
def api(hub):
    return HfApi(endpoint=hub.endpoint, token=TOKEN)


@pytest.fixture
def folder(tmp_path):
    """A folder with a text file, a JSON file and 1 MiB of random bytes as model.safetensors (an LFS file)."""
    root = tmp_path / "folder"
    root.mkdir()
    (root / "notes.txt").write_text("Evolving attention, tested offline.\n")
    (root / "config.json").write_text(json.dumps({"hidden_size": 32, "num_hidden_layers": 2}))
    (root / "model.safetensors").write_bytes(os.urandom(1024 * 1024))
    return root


def local_files(root) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in root.iterdir()}


def test_offline_mode_is_off_and_xet_disabled_by_the_fixture(hub):
    assert constants.HF_HUB_OFFLINE is False and constants.HF_HUB_DISABLE_XET is True
    assert constants.ENDPOINT == hub.endpoint


def test_whoami_and_create_repo(hub, api):
    assert api.whoami()["name"] == "test-user"
    url = api.create_repo(REPO)
    assert url == f"{hub.endpoint}/{REPO}" and url.repo_id == REPO
    assert not hub.is_private(REPO)
    assert hub.files(REPO) == {".gitattributes": GITATTRIBUTES.encode()}
    assert len(hub.commits(REPO)) == 1

    assert api.create_repo("test-user/secret", private=True).repo_id == "test-user/secret"
    assert hub.is_private("test-user/secret")

    with pytest.raises(HfHubHTTPError) as error:
        api.create_repo(REPO)
    assert error.value.response.status_code == 409
    assert api.create_repo(REPO, exist_ok=True) == url
    assert len(hub.commits(REPO)) == 1


def test_upload_folder_round_trip(hub, api, folder, tmp_path):
    api.create_repo(REPO)
    info = api.upload_folder(repo_id=REPO, folder_path=folder, commit_message="add files")

    expected = {".gitattributes": GITATTRIBUTES.encode(), **local_files(folder)}
    assert hub.files(REPO) == expected
    assert hub.commits(REPO)[-1] == info.oid and len(hub.commits(REPO)) == 2
    # Only the weights went through LFS: one batch, one PUT of their sha256, one verify
    assert [kind for kind in hub.requests if "lfs" in kind[1]] == [
        ("POST", f"/{REPO}.git/info/lfs/objects/batch"),
        ("PUT", f"/_lfs/{hashlib.sha256(expected['model.safetensors']).hexdigest()}"),
        ("POST", f"/{REPO}.git/info/lfs/objects/verify"),
    ]
    tree = {entry.path: entry for entry in api.list_repo_tree(REPO, recursive=True)}
    assert tree["model.safetensors"].lfs.size == 1024 * 1024 and tree["notes.txt"].lfs is None

    assert api.list_repo_files(REPO) == sorted(expected)
    for name, data in expected.items():
        path = hf_hub_download(REPO, name, endpoint=hub.endpoint, token=TOKEN, cache_dir=tmp_path / "cache")
        assert open(path, "rb").read() == data
    snapshot = snapshot_download(REPO, endpoint=hub.endpoint, token=TOKEN, cache_dir=tmp_path / "snapshots")
    assert {name: open(os.path.join(snapshot, name), "rb").read() for name in os.listdir(snapshot)} == expected


def test_reupload_is_idempotent(hub, api, folder):
    api.create_repo(REPO)
    first = api.upload_folder(repo_id=REPO, folder_path=folder)
    files, commits = hub.files(REPO), hub.commits(REPO)
    hub.requests.clear()

    again = api.upload_folder(repo_id=REPO, folder_path=folder)

    assert again.oid == first.oid
    assert hub.files(REPO) == files and hub.commits(REPO) == commits
    # The LFS batch is still asked, answers "already stored" (no actions), and no commit is made
    assert hub.requests == [
        ("POST", f"/api/models/{REPO}/preupload/main"),
        ("POST", f"/{REPO}.git/info/lfs/objects/batch"),
        ("GET", f"/api/models/{REPO}/revision/main"),
    ]

    (folder / "notes.txt").write_text("changed\n")
    hub.requests.clear()
    changed = api.upload_folder(repo_id=REPO, folder_path=folder)
    assert hub.commits(REPO) == [*commits, changed.oid]
    assert hub.files(REPO) == {**files, "notes.txt": b"changed\n"}
    assert not [request for request in hub.requests if request[0] == "PUT"]


def test_upload_to_a_new_branch_leaves_main_unchanged(hub, api, folder):
    api.create_repo(REPO)
    api.upload_folder(repo_id=REPO, folder_path=folder)
    main_files, main_commits = hub.files(REPO), hub.commits(REPO)

    api.create_branch(REPO, branch="dev")
    api.create_branch(REPO, branch="dev", exist_ok=True)
    with pytest.raises(HfHubHTTPError) as error:
        api.create_branch(REPO, branch="dev")
    assert error.value.response.status_code == 409
    (folder / "extra.txt").write_text("only on dev\n")
    info = api.upload_folder(repo_id=REPO, folder_path=folder, revision="dev")

    assert hub.files(REPO) == main_files and hub.commits(REPO) == main_commits
    assert hub.files(REPO, "dev") == {**main_files, "extra.txt": b"only on dev\n"}
    assert hub.commits(REPO, "dev") == [*main_commits, info.oid]
    assert {ref.name: ref.target_commit for ref in api.list_repo_refs(REPO).branches} == {
        "main": main_commits[-1],
        "dev": info.oid,
    }
    assert "extra.txt" in api.list_repo_files(REPO, revision="dev")
    assert "extra.txt" not in api.list_repo_files(REPO)
    path = hf_hub_download(REPO, "extra.txt", revision="dev", endpoint=hub.endpoint, token=TOKEN)
    assert open(path, "rb").read() == b"only on dev\n"
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(REPO, "extra.txt", endpoint=hub.endpoint, token=TOKEN)


def test_bad_token_is_rejected_with_401(hub, api, folder):
    bad = HfApi(endpoint=hub.endpoint, token="hf_wrong")
    for call in (lambda: bad.create_repo(REPO), bad.whoami):
        with pytest.raises(HfHubHTTPError) as error:
            call()
        assert error.value.response.status_code == 401
    assert not api.repo_exists(REPO)

    api.create_repo(REPO)
    hub.requests.clear()
    with pytest.raises(HfHubHTTPError) as error:
        bad.upload_folder(repo_id=REPO, folder_path=folder)
    assert error.value.response.status_code == 401
    assert hub.requests == [("POST", f"/api/models/{REPO}/preupload/main")]  # the first upload request fails
    assert len(hub.commits(REPO)) == 1


def test_private_repo_needs_a_token(hub, api, folder, tmp_path):
    api.create_repo(REPO, private=True)
    api.upload_folder(repo_id=REPO, folder_path=folder)

    with pytest.raises(RepositoryNotFoundError) as error:
        hf_hub_download(REPO, "notes.txt", endpoint=hub.endpoint, token=False, cache_dir=tmp_path / "anonymous")
    assert error.value.response.status_code == 401
    with pytest.raises(RepositoryNotFoundError):
        HfApi(endpoint=hub.endpoint, token=False).list_repo_files(REPO)
    with pytest.raises(RepositoryNotFoundError):
        snapshot_download(REPO, endpoint=hub.endpoint, token=False, cache_dir=tmp_path / "anonymous")

    path = hf_hub_download(REPO, "notes.txt", endpoint=hub.endpoint, token=TOKEN, cache_dir=tmp_path / "cache")
    assert open(path, "rb").read() == (folder / "notes.txt").read_bytes()


def test_missing_repo_revision_and_file(hub, api):
    api.create_repo(REPO)
    download = dict(endpoint=hub.endpoint, token=TOKEN)
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("test-user/nothing", "config.json", **download)
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(REPO, ".gitattributes", revision="no-such-branch", **download)
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(REPO, "config.json", **download)
    # A commit id (or a prefix of one) works as a revision
    head = hub.commits(REPO)[-1]
    assert open(hf_hub_download(REPO, ".gitattributes", revision=head, **download)).read() == GITATTRIBUTES
    assert api.repo_info(REPO, revision=head[:7]).sha == head


def test_server_error_on_commit_leaves_the_repo_unchanged(hub, api, folder):
    api.create_repo(REPO)
    files, commits = hub.files(REPO), hub.commits(REPO)
    hub.fail("commit", 500)

    with pytest.raises(HfHubHTTPError) as error:
        api.upload_folder(repo_id=REPO, folder_path=folder)

    assert error.value.response.status_code == 500
    assert hub.requests.count(("POST", f"/api/models/{REPO}/commit/main")) == 1  # the commit is not retried
    assert hub.files(REPO) == files and hub.commits(REPO) == commits
    # Trying again works, and the weights uploaded by the failed attempt are not sent twice
    api.upload_folder(repo_id=REPO, folder_path=folder)
    assert hub.files(REPO) == {**files, **local_files(folder)}
    assert len([request for request in hub.requests if request[0] == "PUT"]) == 1


def test_server_errors_retried_by_the_client(hub, api, folder, tmp_path):
    api.create_repo(REPO)
    hub.fail("lfs_batch", 503)  # retried after a 1 s backoff
    api.upload_folder(repo_id=REPO, folder_path=folder)
    assert hub.requests.count(("POST", f"/{REPO}.git/info/lfs/objects/batch")) == 2
    assert hub.files(REPO)["model.safetensors"] == (folder / "model.safetensors").read_bytes()

    hub.requests.clear()
    hub.fail("resolve", 500)  # the HEAD is tried again at once
    path = hf_hub_download(REPO, "notes.txt", endpoint=hub.endpoint, token=TOKEN, cache_dir=tmp_path / "cache")
    assert open(path, "rb").read() == (folder / "notes.txt").read_bytes()
    assert hub.requests.count(("HEAD", f"/{REPO}/resolve/main/notes.txt")) == 2


def test_lfs_endpoints(hub, api):
    """The LFS protocol by hand: batch -> PUT (checked, chunked bodies work) -> batch again -> lfsFile commit."""
    api.create_repo(REPO)
    session, data = get_session(), b"\x00weights" * 1000
    oid = hashlib.sha256(data).hexdigest()
    batch_url = f"{hub.endpoint}/{REPO}.git/info/lfs/objects/batch"
    batch = {"operation": "upload", "transfers": ["basic"], "objects": [{"oid": oid, "size": len(data)}]}

    answer = session.post(batch_url, headers=AUTH, json=batch).json()
    assert answer["transfer"] == "basic"
    upload = answer["objects"][0]["actions"]["upload"]["href"]
    assert upload == f"{hub.endpoint}/_lfs/{oid}"
    assert session.put(upload, content=data[:-1] + b"!").status_code == 400
    assert session.put(upload, content=iter([data[:100], data[100:]])).status_code == 200  # chunked
    assert "actions" not in session.post(batch_url, headers=AUTH, json=batch).json()["objects"][0]
    assert session.put(upload, content=data).status_code == 400  # no longer announced
    assert session.post(batch_url, json=batch).status_code == 401

    def commit(*operations):
        header = {"key": "header", "value": {"summary": "by hand", "description": ""}}
        lines = [header, *({"key": key, "value": value} for key, value in operations)]
        body = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
        url = f"{hub.endpoint}/api/models/{REPO}/commit/main"
        return session.post(url, headers={**AUTH, "Content-Type": "application/x-ndjson"}, content=body)

    response = commit(("lfsFile", {"path": "w.bin", "algo": "sha256", "oid": "0" * 64, "size": 3}))
    assert response.status_code == 422 and "never uploaded" in response.headers["X-Error-Message"]
    assert len(hub.commits(REPO)) == 1
    response = commit(("lfsFile", {"path": "w.bin", "algo": "sha256", "oid": oid, "size": len(data)}))
    assert response.json()["commitOid"] == hub.commits(REPO)[-1]
    assert hub.files(REPO)["w.bin"] == data
    assert [entry.lfs.sha256 for entry in api.list_repo_tree(REPO) if entry.path == "w.bin"] == [oid]


def test_commit_honours_parent_commit(hub, api):
    api.create_repo(REPO)
    head = hub.commits(REPO)[-1]
    api.upload_file(path_or_fileobj=b"one", path_in_repo="a.txt", repo_id=REPO, parent_commit=head)
    with pytest.raises(HfHubHTTPError) as error:
        api.upload_file(path_or_fileobj=b"two", path_in_repo="b.txt", repo_id=REPO, parent_commit=head)
    assert error.value.response.status_code == 412
    assert hub.files(REPO)["a.txt"] == b"one" and "b.txt" not in hub.files(REPO)


def test_delete_file_and_folder(hub, api):
    files = {"keep.txt": b"keep", "sub/a.txt": b"a", "sub/deeper/b.bin": b"\0b"}
    hub.create_repo(REPO, files=files)
    assert {entry.path for entry in api.list_repo_tree(REPO)} == {".gitattributes", "keep.txt", "sub"}
    tree = {entry.path: entry for entry in api.list_repo_tree(REPO, "sub", recursive=True)}
    assert set(tree) == {"sub/a.txt", "sub/deeper", "sub/deeper/b.bin"}
    assert tree["sub/deeper/b.bin"].lfs.sha256 == hashlib.sha256(b"\0b").hexdigest()

    api.delete_file("keep.txt", repo_id=REPO)
    api.delete_folder("sub", repo_id=REPO)
    assert hub.files(REPO) == {".gitattributes": GITATTRIBUTES.encode()}
    assert len(hub.commits(REPO)) == 4
    with pytest.raises(EntryNotFoundError):
        api.delete_file("keep.txt", repo_id=REPO)


def test_transformers_push_to_hub_and_from_pretrained(hub, monkeypatch, tmp_path):
    hub.patch_client(monkeypatch, token=TOKEN)  # transformers only knows the endpoint from huggingface_hub.constants
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, vocab_size=99
    )
    model = transformers.BertModel(config).eval()
    model.push_to_hub("test-user/tiny-bert", token=TOKEN, commit_message="tiny bert")

    assert set(hub.files("test-user/tiny-bert")) == {".gitattributes", "config.json", "model.safetensors", "README.md"}
    assert sum(method == "PUT" for method, _ in hub.requests) == 1  # the weights went through LFS
    loaded = transformers.AutoModel.from_pretrained("test-user/tiny-bert", token=TOKEN, cache_dir=tmp_path / "cache")
    assert type(loaded) is transformers.BertModel
    input_ids = torch.tensor([[5, 17, 42, 98, 3, 0], [7, 7, 60, 1, 2, 11]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids).last_hidden_state, model(input_ids).last_hidden_state)
