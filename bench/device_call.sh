python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && mkdir -p /tmp/raysite && tar -C /tmp/raysite -xJf .raypkg/ray-site.tar.xz && export PYTHONPATH=/tmp/site:/tmp/raysite:$PWD:$PYTHONPATH || exit
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv; nproc
timeout 250 python3 bench/tune_bench.py $OUT/local --gpu-hours 0.02 --workers 3,6 > $OUT/local.txt 2>&1; echo rc=$?
timeout 170 python3 bench/tune_bench.py $OUT/ray --gpu-hours 0.02 --workers 6 -- --executor ray > $OUT/ray.txt 2>&1; echo rc=$?
rm -rf $OUT/*/runs/*/problems $OUT/*/runs/*/model $OUT/*/runs/*/.triton-cache
cat $OUT/local.txt $OUT/ray.txt | tail -60
