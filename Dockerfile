# syntax=docker/dockerfile:1
# Two images from one build:
#   docker build -t wasm-provisioner:0.1.0 .                          # the provisioner
#   docker build --target guests -t wasm-provisioner-guests:0.1.0 .   # sample guests, for the init container
# The build stage runs .ci/build, the script CI runs, on the Debian release CI uses (bookworm);
# the runtime image is distroless/cc on the same release, so the binary finds the glibc it was
# linked against and nothing else: no shell, no package manager, user 65532.

FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN bash .ci/build release

# Sample guests and a shell to copy them into the plugins volume (deploy/deployment.yaml).
FROM busybox:1.36-musl AS guests
COPY --from=build /src/guests/target/wasm32-wasip2/release/hostpath.wasm /guests/
# The other sample guests, not copied into the plugins volume by deploy/ (no grant file there):
# deployments of local-path or nfs-subdir copy them from here with their own grant files.
COPY --from=build /src/guests/target/wasm32-wasip2/release/local_path.wasm /src/guests/target/wasm32-wasip2/release/nfs_subdir.wasm /guests/samples/
USER 65532:65532

FROM gcr.io/distroless/cc-debian12:nonroot AS runtime
COPY --from=build /src/target/release/wasm-provisioner /usr/local/bin/wasm-provisioner
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/wasm-provisioner"]
CMD ["run", "--plugins=/plugins", "--metrics-address=0.0.0.0:8080"]
