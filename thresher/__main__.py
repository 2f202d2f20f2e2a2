from thresher.cli import run

run()
