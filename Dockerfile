# Gateway image: no torch, no engines. Build: docker build -t slogate-gateway .
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY slogate ./slogate
COPY gateway ./gateway
COPY engines ./engines
COPY policies ./policies
RUN pip install --no-cache-dir . && useradd --create-home slogate
USER slogate
EXPOSE 8000
HEALTHCHECK --interval=5s --timeout=2s --retries=3 \
  CMD python -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2)"
ENTRYPOINT ["slogate"]
CMD ["gateway"]
