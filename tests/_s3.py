"""A real S3 API for the remote-tier tests: moto's standalone server in its own process, started
on a free port the way s3fs's own test suite does it, with throwaway credentials in the
environment (the usual AWS_* variables: the only way smartckpt takes credentials)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request

# Must never appear in a manifest, a journal, a status file, a remote object or a log line.
SECRET = "smartckpt-TEST-SECRET-do-not-log-7f3a9c"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def s3_env(port: int) -> dict[str, str]:
    return {
        "AWS_ACCESS_KEY_ID": "smartckpt-test-key",
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        # keep boto from looking for real credentials or instance metadata
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true",
    }


class MotoServer:
    def __init__(self, port: int) -> None:
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> MotoServer:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self.proc.returncode}")
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/", timeout=2).read()
                return self
            time.sleep(0.2)
        raise RuntimeError("moto server did not come up")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def client(port: int):
    import boto3

    env = s3_env(port)
    return boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name="us-east-1",
    )


def all_objects(port: int, bucket: str) -> dict[str, bytes]:
    c = client(port)
    out: dict[str, bytes] = {}
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for obj in page.get("Contents", []):
            out[obj["Key"]] = c.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
    return out


class Gate:
    """A TCP forwarder in front of the S3 server that can refuse connections (nothing listens on
    its port while it is shut) and open again: an S3 endpoint that is down, then comes back."""

    def __init__(self, target_port: int) -> None:
        import threading

        self.target = target_port
        self.port = free_port()
        self._server: socket.socket | None = None
        self._lock = threading.Lock()

    def open(self) -> Gate:
        import threading

        with self._lock:
            if self._server is not None:
                return self
            srv = socket.socket()
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            srv.bind(("127.0.0.1", self.port))
            srv.listen(64)
            self._server = srv
        threading.Thread(target=self._accept, args=(srv,), daemon=True).start()
        return self

    def shut(self) -> None:
        with self._lock:
            srv, self._server = self._server, None
        if srv is not None:
            with contextlib.suppress(OSError):
                srv.shutdown(socket.SHUT_RDWR)
            srv.close()

    def _accept(self, srv: socket.socket) -> None:
        import threading

        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return  # shut
            try:
                up = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                conn.close()
                continue
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
