from sgl_remote_kv.codec.calibration.cli import run

run()
