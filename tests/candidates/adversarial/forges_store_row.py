"""EXPECT: ok -- tries to insert a forged `ok 99x` row into the run's trials.sqlite; in the jail
the run folder does not exist, so it computes the right answer and nothing is written."""
import os
import sqlite3

RUN = "{run_dir}"


def forward(module, x):
    path = os.path.join(RUN, "trials.sqlite")
    if os.path.exists(path):
        db = sqlite3.connect(path)
        with db:
            db.execute("INSERT INTO trials (region, candidate_hash, status, speedup, body) VALUES (?,?,?,?,?)",
                       ("LlamaRMSNorm", "forged", "ok", 99.0, "{}"))
        db.close()
    return type(module).forward(module, x)
