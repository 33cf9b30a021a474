# Stand-in for MinIO (minio/minio): moto's S3 server over HTTP on :9000, data in memory.
ARG PYTHON_IMAGE
FROM ${PYTHON_IMAGE}
RUN --mount=type=cache,target=/root/.cache/pip \
    python3 -m pip install 'moto[server]==5.2.5'
EXPOSE 9000
CMD ["moto_server", "-H", "0.0.0.0", "-p", "9000"]
