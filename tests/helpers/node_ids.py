"""Every node id the pack registers, written out: node ids are forever (saved workflows name them), so a test
that lists what the pack or a live server offers compares against this literal set, not against the pack itself."""

KILN_NODE_IDS = {
    "KilnCaptionImages",
    "KilnLoadDataset",
    "KilnEncodeImages",
    "KilnEncodeCaptions",
    "KilnTrainingOptions",
    "KilnValidationSettings",
    "KilnTrainLoRA",
    "KilnLoadRun",
    "KilnApplyEMA",
    "KilnSaveLoRA",
    "KilnInvertAdapter",
    "KilnLossGraph",
    "KilnMergeLoRAs",
    "KilnResizeLoRA",
    "KilnExtractLoRA",
    "KilnConvertLoRA",
    "KilnSaveDiffusionModel",
    "KilnTrainLoRATorchrun",
    "KilnOptimizerOptions",
    "KilnNoiseLossOptions",
    "KilnEMAHoldoutOptions",
    "KilnAdapterOptions",
    "KilnSpeedMemoryOptions",
    "KilnSavingLoggingOptions",
}
