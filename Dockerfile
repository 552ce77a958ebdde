# One image for the web and worker processes (docker-compose.yml).
#
# AUDIOSITE_CUDA=1 (build argument; docker-compose.gpu.yml sets it for the worker) adds the CUDA
# runtime libraries that onnxruntime-gpu and CTranslate2 load (requirements-cuda.txt: NVIDIA's
# wheels, no CUDA base image) and registers their folders with the dynamic loader. The default, 0,
# is the CPU image: onnxruntime-gpu is installed either way and falls back to the CPU without them.
# The GPU driver comes from the host (NVIDIA Container Toolkit), never from the image.
FROM python:3.11-slim
ARG AUDIOSITE_CUDA=0
ENV PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
WORKDIR /app
COPY requirements.txt requirements-cuda.txt ./
RUN pip install --no-cache-dir --no-deps -r requirements.txt
RUN if [ "$AUDIOSITE_CUDA" = "1" ]; then \
      pip install --no-cache-dir --no-deps -r requirements-cuda.txt \
      && python -c "import site; print(site.getsitepackages()[0])" > /tmp/site \
      && find "$(cat /tmp/site)/nvidia" -name 'lib*.so*' -printf '%h\n' | sort -u > /etc/ld.so.conf.d/nvidia-wheels.conf \
      && ldconfig && rm /tmp/site; \
    elif [ "$AUDIOSITE_CUDA" != "0" ]; then echo "AUDIOSITE_CUDA must be 0 or 1" >&2; exit 1; fi
COPY . .
