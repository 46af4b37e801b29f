import os, sys
sys.path.insert(0, os.getcwd())
import fxspeed
import tests.workers.tensor_parallel_worker as w
from tests.workers.common import run_cases
def gpt_sgd(): return w.parity("gpt", fxspeed.Config(tensor=2, lr=1e-2, optimizer="sgd", grad_clip=0.05))
def gpt_adam(): return w.parity("gpt", fxspeed.Config(tensor=2, lr=1e-4, eps=1e-6, grad_clip=0.05))
def gpt_noclip(): return w.parity("gpt", fxspeed.Config(tensor=2, lr=1e-2, optimizer="sgd"))
if __name__ == "__main__":
    run_cases({"gpt_sgd": gpt_sgd, "gpt_adam": gpt_adam, "gpt_noclip": gpt_noclip})
